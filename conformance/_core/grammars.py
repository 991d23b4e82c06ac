"""Structured outputs for the harness: the tokenizer the grammars compile against, and the
catalogue of grammars a request may name (``AddRequest.grammar``).

vLLM's ``StructuredOutputManager`` loads the tokenizer ``ModelConfig.tokenizer`` names; the
harness's models have none, so this module builds one from a fixed list of strings: the model's
three special ids, 256 byte-level tokens and byte-pair merges up to the model's vocabulary
size. It is bundled for the tiny model (``assets/tiny-tokenizer``, rebuilt byte for byte by
``write_tokenizer``) and written under the temporary directory for any other vocabulary. The
catalogue holds a JSON schema, a regex, a choice and a grammar that fails to compile; each is
turned into the ``StructuredOutputsParams`` the engine's input processor would hand on
(validated and given its backend, through ``vllm_compat.structured``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


class _Config(Protocol):
    """What is read of a ``HarnessConfig`` here (not imported: ``config`` imports this)."""

    @property
    def model(self) -> str: ...
    @property
    def structured_outputs(self) -> str: ...
    def model_shape(self) -> dict[str, Any]: ...


BUNDLED_TOKENIZER = Path(__file__).parents[1] / "assets" / "tiny-tokenizer"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos of the tiny model
# Strings whose byte pairs are merged, in this order, until the vocabulary is full: the
# punctuation and words the catalogue's grammars use first (so one token can span a grammar
# boundary, as real vocabularies' tokens do), then pairs of the regex's characters.
_MERGE_WORDS = (
    '{"',
    '"}',
    '":',
    '",',
    '": "',
    '", "',
    "true",
    "false",
    "null",
    "name",
    "age",
    "yes",
    "no",
    "maybe",
    *(a + b for a in "abc-0123456789 " for b in "abc-0123456789 "),
)


def _byte_symbols() -> list[str]:
    """One printable character per byte value, as byte-level BPE vocabularies spell bytes:
    printable Latin-1 bytes stand for themselves, the others for characters from U+0100 on."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of at most ``vocab_size`` ids (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"a byte-level tokenizer needs {len(SPECIAL_TOKENS) + 256} ids")
    symbols = _byte_symbols()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({s: len(SPECIAL_TOKENS) + b for b, s in enumerate(symbols)})
    merges: list[tuple[str, str]] = []
    for word in _MERGE_WORDS:
        spelled = [symbols[b] for b in word.encode()]
        head = spelled[0]
        for ch in spelled[1:]:
            if head + ch not in vocab and len(vocab) < vocab_size:
                merges.append((head, ch))
                vocab[head + ch] = len(vocab)
            head += ch
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_files(shape: dict[str, Any]) -> dict[str, str]:
    """File name -> text of the tokenizer folder for a model of ``shape`` (its config.json):
    the tokenizer, its Hugging Face config, and the model's config (which vLLM's loader reads
    from the tokenizer's folder too)."""
    tok = build_tokenizer(int(shape.get("vocab_size", 512)))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "model_max_length": int(shape.get("max_position_embeddings", 512)),
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=1) + "\n",
        "config.json": json.dumps(shape, indent=1) + "\n",
    }


def write_tokenizer(folder: Path, shape: dict[str, Any]) -> Path:
    """Write the tokenizer folder for ``shape`` to ``folder`` (each file replaced atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(shape).items():
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's files are private; these are package data
        os.replace(tmp, folder / name)
    return folder


def tokenizer_folder(cfg: _Config) -> Path:
    """The folder ``ModelConfig.tokenizer`` names for ``cfg``'s model: the bundled one for the
    tiny model's vocabulary, else one written once under the temporary directory."""
    shape = cfg.model_shape()
    files = tokenizer_files(shape)
    bundled = BUNDLED_TOKENIZER / "tokenizer.json"
    if bundled.is_file() and bundled.read_text() == files["tokenizer.json"]:
        return BUNDLED_TOKENIZER
    digest = hashlib.sha256("".join(files.values()).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "omni-conformance-tokenizers" / digest
    if not (folder / "tokenizer.json").is_file():
        write_tokenizer(folder, shape)
    return folder


# ---- the catalogue ----------------------------------------------------------------------


@dataclass(frozen=True)
class Grammar:
    # ``StructuredOutputsParams`` keyword arguments.
    params: dict[str, Any]
    # Whether the engine's input processor validates it first (as vLLM's Python front end
    # does). The failing entry skips it, as a front end that leaves validation to the engine
    # would send it: only then does a grammar reach the engine that cannot compile.
    validated: bool = True


CATALOGUE: dict[str, Grammar] = {
    "json": Grammar(
        {
            "json": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 4},
                    "age": {"type": "integer"},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        }
    ),
    "regex": Grammar({"regex": "[abc]{2,4}(-[0-9]{1,2})?"}),
    "choice": Grammar({"choice": ["yes", "no", "maybe"]}),
    # Refers to a rule it never defines: xgrammar refuses it when the engine compiles it.
    "broken": Grammar({"grammar": 'root ::= "a" undefined_rule'}, validated=False),
}

# ``AddRequest.grammar`` values an axis draws: none first (the default), then the catalogue.
GRAMMAR_VALUES: tuple[str | None, ...] = (None, *CATALOGUE)


def constrain(sp: SamplingParams, name: str, cfg: _Config) -> None:
    """Give ``sp`` grammar ``name`` as the engine's input processor hands it on: validated
    against the configured backend (which also records the backend on it, and turns a choice
    into a grammar), or, for the failing entry, with only the backend recorded."""
    from vllm.sampling_params import StructuredOutputsParams

    from conformance._core import vllm_compat as vc

    if not cfg.structured_outputs:
        raise ValueError(
            f"a request names grammar {name!r} but HarnessConfig.structured_outputs is off"
        )
    try:
        grammar = CATALOGUE[name]
    except KeyError:
        raise ValueError(f"unknown grammar {name!r}; known {sorted(CATALOGUE)}") from None
    sp.structured_outputs = StructuredOutputsParams(**grammar.params)
    if grammar.validated:
        model_config, outputs_config, tokenizer = _front_end(
            cfg.model, str(tokenizer_folder(cfg)), cfg.structured_outputs
        )
        # No speculative configuration: it bears on no structured-output check.
        sp.verify(model_config, None, outputs_config, tokenizer)
    else:
        vc.assign_backend(sp.structured_outputs, cfg.structured_outputs)


@functools.cache
def _front_end(model: str, tokenizer: str, backend: str) -> tuple[Any, Any, Any]:
    """What the input processor validates with: the model's configuration, the structured
    outputs configuration and the tokenizer (built once per process)."""
    from vllm.config import ModelConfig, StructuredOutputsConfig
    from vllm.tokenizers import cached_tokenizer_from_config

    model_config = ModelConfig(model=model, tokenizer=tokenizer, dtype="float32")
    return (
        model_config,
        StructuredOutputsConfig(backend=backend),  # type: ignore[arg-type]  # checked there
        cached_tokenizer_from_config(model_config),
    )
