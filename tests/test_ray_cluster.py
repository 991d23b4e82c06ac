"""Stages on two machines, simulated by two Ray nodes on this host (``ray.cluster_utils``).

The talker is pinned to the second node by a custom resource from the pipeline file
(``ray_resources``), so its chunks come back to the driver through Ray's object store rather
than shared memory, while the thinker's still use shared memory; the outputs must still be the
in-process ones, bit for bit. The driver joins the cluster by address, as ``--ray-address``
does, and closes its connection when the pipeline closes. A module of its own: it needs a Ray
cluster of its own, which cannot coexist in one process with another module's local instance.
"""

from __future__ import annotations

import dataclasses

import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from omni_runtime.engine.graph import RayResources, load_pipeline_config  # noqa: E402
from omni_runtime.engine.ray_stage import RayStageEngine  # noqa: E402

CONFIG = load_pipeline_config()
PROMPTS = ["Hello there", "short"]


@pytest.mark.slow
def test_stages_on_two_nodes_pass_payloads_through_the_object_store() -> None:
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2, resources={"talker_host": 1})
        cluster.wait_for_nodes()
        talker = dataclasses.replace(
            CONFIG.ar_stages[1], ray_resources=RayResources(resources=(("talker_host", 1.0),))
        )
        config = dataclasses.replace(
            CONFIG, stages=tuple(talker if s.id == "talker" else s for s in CONFIG.stages)
        )
        from omni_runtime.engine import OmniPipeline

        with OmniPipeline(config, backend="ray", ray_address=cluster.address) as p:
            engines = p.orchestrator.engines
            thinker_engine, talker_engine = engines["thinker"], engines["talker"]
            assert isinstance(talker_engine, RayStageEngine)
            assert isinstance(thinker_engine, RayStageEngine)
            assert talker_engine.node != thinker_engine.node
            # The talker's node is not the driver's: its chunks (to code2wav) come by value.
            assert not talker_engine.uses_shared_memory
            assert thinker_engine.uses_shared_memory
            results = p.generate(["Hello there", "short"], max_text_tokens=6, max_codec_tokens=24)
        assert not ray.is_initialized()  # joined by address: the driver's connection is closed
    finally:
        cluster.shutdown()
    with OmniPipeline(config) as ref_pipeline:
        ref = ref_pipeline.generate(
            ["Hello there", "short"], max_text_tokens=6, max_codec_tokens=24
        )
    assert [
        (r.text_token_ids, r.codec_token_ids, r.waveform.numpy().tobytes()) for r in results
    ] == [(r.text_token_ids, r.codec_token_ids, r.waveform.numpy().tobytes()) for r in ref]
