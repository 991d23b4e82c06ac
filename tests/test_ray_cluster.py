"""Stages on two machines, simulated by two Ray nodes on this host (``ray.cluster_utils``).

The shipped ``omni_runtime/configs/two_hosts_pipeline.json`` pins the thinker to a node with
the custom resource ``thinker_host`` (the head node, where the driver runs) and the talker to
one with ``talker_host`` (the second node), as the README's two-machine recipe does. The
talker's chunks then come back to the driver through Ray's object store, the thinker's through
shared memory, and the outputs must still be the in-process ones, bit for bit. The driver joins
the cluster by address, as ``--ray-address`` does, and closes its connection when the pipeline
closes. A module of its own: it needs a Ray cluster of its own, which cannot coexist in one
process with another module's local instance.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from omni_runtime.engine.graph import (  # noqa: E402
    ARStageSpec,
    RayResources,
    default_pipeline_path,
    load_pipeline_config,
)
from omni_runtime.engine.ray_stage import RayStageEngine  # noqa: E402

# The shipped example: the default pipeline with its LM stages pinned by custom resources.
TWO_HOSTS = default_pipeline_path().with_name("two_hosts_pipeline.json")
PROMPTS = ["Hello there", "short"]


@pytest.mark.slow
def test_stages_on_two_nodes_pass_payloads_through_the_object_store() -> None:
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    # The head node is "machine A" (it also runs this driver), the second one "machine B".
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            "resources": {"thinker_host": 1},
        },
    )
    try:
        cluster.add_node(num_cpus=2, resources={"talker_host": 1})
        cluster.wait_for_nodes()
        config = load_pipeline_config(TWO_HOSTS)
        talker = config.stage("talker")
        assert isinstance(talker, ARStageSpec)
        assert talker.ray_resources == RayResources(1.0, 0.0, None, (("talker_host", 1.0),))
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
            results = p.generate(PROMPTS, max_text_tokens=6, max_codec_tokens=24)
        assert not ray.is_initialized()  # joined by address: the driver's connection is closed
    finally:
        cluster.shutdown()
    with OmniPipeline() as ref_pipeline:  # the default file, in process
        ref = ref_pipeline.generate(PROMPTS, max_text_tokens=6, max_codec_tokens=24)
    assert [
        (r.text_token_ids, r.codec_token_ids, r.waveform.numpy().tobytes()) for r in results
    ] == [(r.text_token_ids, r.codec_token_ids, r.waveform.numpy().tobytes()) for r in ref]
