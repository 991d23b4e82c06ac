"""Tests for omni_runtime.models: weight folders, HF parity, the paged decomposition, code2wav.

Every test runs against a private model root (``OMNI_RUNTIME_MODEL_DIR``) so the suite never
touches the user's cache and xdist workers never share a half-written folder by accident.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from omni_runtime.models import (
    CODEC_EOS_ID,
    MODEL_DIR_ENV,
    MODEL_NAMES,
    Code2Wav,
    LlamaLM,
    StreamingDecoder,
    load_model,
    model_dir,
    reference_attention,
)
from omni_runtime.payload import StagePayload

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("omni_models")


@pytest.fixture(autouse=True)
def _private_root(models_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODEL_DIR_ENV, str(models_root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _load_from(models_root: Path, name: str) -> torch.nn.Module:
    """``load_model(name)`` with the private model root (module fixtures cannot monkeypatch)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MODEL_DIR_ENV, str(models_root))
        return load_model(name)


@pytest.fixture(scope="module")
def thinker(models_root: Path) -> LlamaLM:
    m = _load_from(models_root, "thinker")
    assert isinstance(m, LlamaLM)
    return m


@pytest.fixture(scope="module")
def code2wav(models_root: Path) -> Code2Wav:
    m = _load_from(models_root, "code2wav")
    assert isinstance(m, Code2Wav)
    return m


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prompts(n: int, lengths: list[int], low: int, high: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (lengths[i % len(lengths)],), generator=g) for i in range(n)]


def _child_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env[MODEL_DIR_ENV] = str(root)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


_CHILD = textwrap.dedent(
    """
    import sys
    from omni_runtime.models import model_dir
    print(model_dir(sys.argv[1]))
    """
)


# --- 1. folders -------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_dir_creates_folder_idempotently(name: str, models_root: Path) -> None:
    path = model_dir(name)
    assert path.parent == models_root
    assert path.name.startswith(f"{name}-")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    first = _sha256(path / "model.safetensors")
    cfg_bytes = (path / "config.json").read_bytes()
    assert model_dir(name) == path
    assert _sha256(path / "model.safetensors") == first
    assert (path / "config.json").read_bytes() == cfg_bytes
    assert not [p for p in models_root.iterdir() if ".tmp-" in p.name]


def test_concurrent_creation_is_atomic_and_deterministic(tmp_path: Path) -> None:
    """Two fresh processes race to create the thinker in an empty root: both must return the
    same complete folder, leave no temp dirs, and write the same bytes as this process."""
    root = tmp_path / "race"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, "thinker"],
            env=_child_env(root),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    paths = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        paths.append(Path(stdout.strip().splitlines()[-1]))
    assert paths[0] == paths[1]
    assert [p.name for p in root.iterdir()] == [paths[0].name]
    ours = model_dir("thinker")
    assert paths[0].name == ours.name
    assert _sha256(paths[0] / "model.safetensors") == _sha256(ours / "model.safetensors")
    assert (paths[0] / "config.json").read_bytes() == (ours / "config.json").read_bytes()


def test_config_json_fields() -> None:
    for name, eos in (("thinker", 2), ("talker", CODEC_EOS_ID)):
        cfg = json.loads((model_dir(name) / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["model_type"] == "llama"
        assert cfg["tie_word_embeddings"] is False
        assert cfg["eos_token_id"] == eos
        assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (64, 2, 16)
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert json.loads((model_dir("thinker") / "config.json").read_text())["vocab_size"] == 512
    assert json.loads((model_dir("talker") / "config.json").read_text())["vocab_size"] == 264
    c2w = json.loads((model_dir("code2wav") / "config.json").read_text())
    assert c2w["architectures"] == ["OmniCode2Wav"]
    assert c2w["model_type"] == "omni_code2wav"
    assert c2w["hop_length"] == 240 and c2w["sample_rate"] == 24000
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert key in c2w


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError) as exc:
        model_dir("vocoder")
    msg = str(exc.value)
    assert "vocoder" in msg
    for known in MODEL_NAMES:
        assert known in msg
    with pytest.raises(ValueError, match="vocoder"):
        load_model("vocoder")


def test_thinker_post_is_the_thinker_with_a_payload_postprocess(thinker: LlamaLM) -> None:
    """Same weights and config as the thinker but for the postprocess its config names; the
    thinker's folder does not mention it, so its version is unchanged."""
    post_dir, thinker_dir = model_dir("thinker-post"), model_dir("thinker")
    assert _sha256(post_dir / "model.safetensors") == _sha256(thinker_dir / "model.safetensors")
    cfg = json.loads((post_dir / "config.json").read_text())
    assert cfg.pop("omni_payload_postprocess") == "positions"
    assert cfg == json.loads((thinker_dir / "config.json").read_text())
    post = load_model("thinker-post")
    assert isinstance(post, LlamaLM) and thinker.omni_postprocess is None
    hook = post.omni_postprocess
    assert hook is not None
    payload = StagePayload("r", 5, 3, conditioning=torch.ones(64))
    assert hook(payload) is payload
    assert torch.equal(payload.multimodal["positions"], torch.tensor([5, 6, 7]))
    assert (payload.request_id, payload.start, payload.num_tokens) == ("r", 5, 3)
    assert payload.hidden is None and torch.equal(payload.conditioning, torch.ones(64))


# --- 2. HF parity -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_thinker(models_root: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MODEL_DIR_ENV, str(models_root))
        path = model_dir("thinker")
    model = transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    return model.eval()


def test_state_dict_keys_match_hf(thinker: LlamaLM, hf_thinker) -> None:  # type: ignore[no-untyped-def]
    assert set(thinker.state_dict()) == set(hf_thinker.state_dict())
    for k, v in hf_thinker.state_dict().items():
        assert torch.equal(v, thinker.state_dict()[k]), k


def test_logits_match_hf(thinker: LlamaLM, hf_thinker) -> None:  # type: ignore[no-untyped-def]
    for ids in _prompts(4, [5, 17, 33, 40], 3, 512, seed=1):
        with torch.no_grad():
            ref = hf_thinker(ids[None]).logits[0]
        torch.testing.assert_close(thinker(ids), ref, atol=1e-4, rtol=0)
    batch = torch.stack(_prompts(2, [9], 3, 512, seed=2))
    with torch.no_grad():
        torch.testing.assert_close(thinker(batch), hf_thinker(batch).logits, atol=1e-4, rtol=0)


def test_greedy_generation_matches_hf(thinker: LlamaLM, hf_thinker) -> None:  # type: ignore[no-untyped-def]
    for ids in _prompts(4, [5, 12, 25, 40], 3, 512, seed=3):
        ours = thinker.greedy_generate(ids, 16)
        with torch.no_grad():
            out = hf_thinker.generate(
                ids[None],
                attention_mask=torch.ones_like(ids)[None],
                max_new_tokens=16,
                do_sample=False,
            )
        assert out[0, ids.numel() :].tolist() == ours.tolist()


def test_talker_loads_in_hf() -> None:
    transformers = pytest.importorskip("transformers")
    talker = load_model("talker")
    assert isinstance(talker, LlamaLM) and talker.vocab_size == 264
    hf = transformers.LlamaForCausalLM.from_pretrained(
        model_dir("talker"),
        dtype=torch.float32,
        attn_implementation="eager",
        local_files_only=True,
    ).eval()
    ids = _prompts(1, [21], 0, 256, seed=4)[0]
    with torch.no_grad():
        torch.testing.assert_close(talker(ids), hf(ids[None]).logits[0], atol=1e-4, rtol=0)


def test_greedy_generation_is_not_degenerate(thinker: LlamaLM) -> None:
    outs = [
        thinker.greedy_generate(ids, 16, stop_at_eos=False).tolist()
        for ids in _prompts(4, [5, 10, 20, 30], 3, 512, seed=5)
    ]
    for out in outs:
        assert len(set(out)) >= 6, out
    assert len({tuple(o) for o in outs}) == len(outs)


# --- 3. decomposition vs. incremental decoding ---------------------------------------------


class _GrowingCache:
    """Contiguous per-layer KV cache: the simplest stand-in for a paged cache."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k])
        self.v[layer] = v if old_v is None else torch.cat([old_v, v])
        return reference_attention(q, self.k[layer], self.v[layer])


@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 1, 1, 1, 1, 1], [3, 4, 5]])
def test_incremental_decoding_matches_full_recompute(thinker: LlamaLM, chunks: list[int]) -> None:
    ids = _prompts(1, [sum(chunks)], 3, 512, seed=6)[0]
    with torch.no_grad():
        full = thinker(ids)
        cache = _GrowingCache(thinker.num_layers)
        parts, start = [], 0
        for n in chunks:
            pos = torch.arange(start, start + n)
            hidden = thinker.forward_layers(thinker.embed(ids[start : start + n]), pos, cache)
            parts.append(thinker.logits(hidden))
            start += n
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-4, rtol=0)


def test_incremental_greedy_matches_greedy_generate(thinker: LlamaLM) -> None:
    ids = _prompts(1, [8], 3, 512, seed=7)[0]
    expected = thinker.greedy_generate(ids, 10, stop_at_eos=False).tolist()
    cache = _GrowingCache(thinker.num_layers)
    got: list[int] = []
    with torch.no_grad():
        hidden = thinker.forward_layers(thinker.embed(ids), torch.arange(ids.numel()), cache)
        for step in range(10):
            nxt = int(thinker.logits(hidden[-1:])[0].argmax())
            got.append(nxt)
            pos = torch.tensor([ids.numel() + step])
            hidden = thinker.forward_layers(thinker.embed(torch.tensor([nxt])), pos, cache)
    assert got == expected


def test_forward_embeds_equals_ids_path() -> None:
    talker = load_model("talker")
    assert isinstance(talker, LlamaLM)
    ids = _prompts(1, [11], 0, 256, seed=8)[0]
    with torch.no_grad():
        torch.testing.assert_close(talker.forward_embeds(talker.embed(ids)), talker(ids))


def test_talker_greedy_from_embeds() -> None:
    talker = load_model("talker")
    assert isinstance(talker, LlamaLM)
    ids = _prompts(1, [9], 0, 256, seed=9)[0]
    by_ids = talker.greedy_generate(ids, 12)
    assert by_ids.tolist() == talker.greedy_generate_from_embeds(talker.embed(ids), 12).tolist()
    # A prompt that is not any token's embedding (the thinker->talker projection case).
    soft = talker.embed(ids) + 0.3 * torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    out = talker.greedy_generate_from_embeds(soft, 12, stop_at_eos=False)
    assert out.shape == (12,) and int(out.max()) < 264


def test_attn_fn_shape_contract(thinker: LlamaLM) -> None:
    seen: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((layer, tuple(q.shape), tuple(k.shape)))
        return reference_attention(q, k, v)

    with torch.no_grad():
        thinker.forward_layers(thinker.embed(torch.arange(3, 10)), torch.arange(7), attn)
    assert seen == [(0, (7, 4, 16), (7, 2, 16)), (1, (7, 4, 16), (7, 2, 16))]


# --- 4. code2wav --------------------------------------------------------------------------


def _codes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_code2wav_shape_range_determinism(code2wav: Code2Wav) -> None:
    assert code2wav.hop_length == 240 and code2wav.sample_rate == 24000
    codes = _codes(37)
    wav = code2wav.decode(codes)
    assert wav.shape == (37 * 240,) and wav.dtype == torch.float32
    assert float(wav.abs().max()) <= 1.0
    assert float(wav.std()) > 1e-3  # actually produces signal
    again = load_model("code2wav")
    assert isinstance(again, Code2Wav)
    assert torch.equal(again.decode(codes), wav)


@pytest.mark.parametrize(
    "chunks",
    [[1] * 20, [2, 3, 5, 7, 3], [19, 1], [1, 19], [4, 0, 4, 12], [20]],
)
def test_code2wav_streaming_equals_whole(code2wav: Code2Wav, chunks: list[int]) -> None:
    codes = _codes(sum(chunks), seed=1)
    whole = code2wav.decode(codes)
    dec = StreamingDecoder(code2wav)
    out, start = [], 0
    for n in chunks:
        piece = dec.push(codes[start : start + n])
        assert piece.shape == (n * 240,)
        out.append(piece)
        start += n
    assert dec.frames_seen == sum(chunks)
    tail = dec.flush()
    assert tail.numel() == 0 and dec.frames_seen == 0
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-6, rtol=0)
    # After flush the decoder starts a fresh sequence.
    torch.testing.assert_close(dec.push(codes[:3]), code2wav.decode(codes[:3]), atol=1e-6, rtol=0)


def test_code2wav_rejects_control_tokens(code2wav: Code2Wav) -> None:
    with pytest.raises(ValueError, match="codec ids"):
        code2wav.decode(torch.tensor([1, 2, CODEC_EOS_ID]))
