# ruff: noqa: RUF001, RUF003 - DeepSeek's tokens are written with fullwidth bars (｜), as its vocabulary has them
"""Test models of the families people run: REPLY with each family's chat template and tokens.

What: :data:`FAMILIES` lists, per model family (Qwen3, Qwen3-Coder, Qwen3.5, gpt-oss,
Llama 3.3, Mistral Small, Gemma 3 and 4, GLM 4.6, DeepSeek R1 and V3.1, Kimi K2, MiniMax M2,
LFM2, Nemotron, Seed-OSS, Granite, Command R), a chat template written here that reproduces
that family's rules (``_families_a/b/c.py``), its special tokens, and what its template does
that a daemon must cope with. :func:`ensure_family_model` copies the REPLY model (TINY's shape,
answering a chat turn briefly) with that template and with the family's special tokens in its
vocabulary, so its turn markers tokenize as the control tokens they are in the real model.

How the copy is made (only metadata and one tensor change): the vocabulary's last merges give
up their ids to the family's extra special tokens (their merges are dropped, so text never
tokenizes to them; each is typed CONTROL and its output row scaled down as the generator does
for control tokens, so decoding never picks one), and the three control tokens REPLY ends with
are renamed to the family's BOS, turn-start and end-of-turn tokens, which keeps REPLY's answer
ending with the family's own end of turn. ``add_bos_token`` is the family's. Everything else
(weights, merges kept, the other tokens) is REPLY's, so these models are as cheap as TINY.

Why: modeld renders conversations with the model's own template; the families' templates
differ in what they refuse, in what they render otherwise once more turns follow, and in the
fields they read. Tests run every family over every API and check modeld's prompt against
llama-server's rendering (``tests/models/test_families.py``, ``tests/models/test_families_oracle.py``).

What not: the templates are not the real ones (those are not copied here), and the weights do
not write calls in a family's format by themselves: tests supply the calls in the history.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from modeld.testmodels._families_a import GPT_OSS, LLAMA33, MISTRAL_SMALL, QWEN3, QWEN3_CODER, QWEN35
from modeld.testmodels._families_b import DEEPSEEK_R1, DEEPSEEK_V31, GEMMA3, GEMMA4, GLM46, KIMI_K2
from modeld.testmodels._families_c import COMMAND_R, GRANITE, LFM2, MINIMAX_M2, NEMOTRON, SEED_OSS
from modeld.testmodels._spec import ModelSpec

__all__ = ["FAMILIES", "FAMILY_VERSION", "Family", "ensure_family_model", "family"]

FAMILY_VERSION: Final = 1
"""Bump when the bytes written for an unchanged family could change (the copy's recipe)."""

_CONTROL = 3  # llama.cpp's token type for control tokens
_CONTROL_OUTPUT_SCALE = 0.02  # what the generator does to control tokens' output rows


@dataclass(frozen=True)
class Family:
    """A model family's template and tokens. ``bos``/``start``/``eos``: the texts of its BOS
    (``""``: it has none of its own), turn-start and end-of-turn tokens; ``specials`` its other
    control tokens; ``add_bos`` whether tokenizing adds BOS; ``tools``: its template writes tool
    calls and results (Gemma 3's has no tools: a tool result breaks its role alternation);
    ``rules``: what its template does that a daemon must cope with (for people)."""

    name: str
    template: str
    start: str
    eos: str
    bos: str = ""
    add_bos: bool = False
    specials: tuple[str, ...] = ()
    tools: bool = True
    rules: str = ""


_DEEPSEEK = (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)

FAMILIES: Final[tuple[Family, ...]] = (
    Family(
        "qwen3",
        QWEN3,
        "<|im_start|>",
        "<|im_end|>",
        rules="drops a turn's <think> once a later user turn exists; Hermes JSON calls",
    ),
    Family(
        "qwen3-coder",
        QWEN3_CODER,
        "<|im_start|>",
        "<|im_end|>",
        rules="XML calls with raw parameter values (arguments must be objects)",
    ),
    Family(
        "qwen3.5",
        QWEN35,
        "<|im_start|>",
        "<|im_end|>",
        rules="refuses a conversation without a user query; keeps <think> after the last query; "
        "the generation prompt opens <think>; content parts",
    ),
    Family(
        "gpt-oss",
        GPT_OSS,
        "<|start|>",
        "<|return|>",
        bos="<|startoftext|>",
        specials=("<|message|>", "<|channel|>", "<|end|>", "<|call|>", "<|constrain|>"),
        rules="harmony channels; the date (strftime_now) and reasoning effort in the system "
        "message; reasoning in the thinking field; a tool result needs a call before it",
    ),
    Family(
        "llama3.3",
        LLAMA33,
        "<|start_header_id|>",
        "<|eot_id|>",
        bos="<|begin_of_text|>",
        add_bos=True,
        specials=("<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
        rules="tools go in the first user message (refused without one); one call per message",
    ),
    Family(
        "mistral-small",
        MISTRAL_SMALL,
        "[INST]",
        "</s>",
        bos="<s>",
        add_bos=True,
        specials=(
            "[/INST]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[CALL_ID]",
            "[ARGS]",
            "[TOOL_RESULTS]",
            "[TOOL_CONTENT]",
            "[/TOOL_RESULTS]",
        ),
        rules="tools move before the last user message; roles must alternate; call ids of 9 characters",
    ),
    Family(
        "gemma3",
        GEMMA3,
        "<start_of_turn>",
        "<end_of_turn>",
        bos="<bos>",
        add_bos=True,
        tools=False,
        rules="no system turn, no tools; roles must alternate (a tool result is refused)",
    ),
    Family(
        "gemma4",
        GEMMA4,
        "<|turn>",
        "<turn|>",
        bos="<bos>",
        add_bos=True,
        specials=(
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            '<|"|>',
            "<|think|>",
            "<|channel>",
            "<channel|>",
        ),
        rules="a call's turn shows the results that follow it (renders otherwise once they exist)",
    ),
    Family(
        "glm4.6",
        GLM46,
        "<|user|>",
        "<|endoftext|>",
        bos="[gMASK]",
        specials=("<sop>", "<|system|>", "<|assistant|>", "<|observation|>"),
        rules="tojson(ensure_ascii=False); arg_key/arg_value calls (objects only); /nothink",
    ),
    Family(
        "deepseek-r1",
        DEEPSEEK_R1,
        "<｜User｜>",
        "<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        add_bos=True,
        specials=_DEEPSEEK[1:],
        rules="drops text before </think>; the generation prompt opens <think>",
    ),
    Family(
        "deepseek-v3.1",
        DEEPSEEK_V31,
        "<｜User｜>",
        "<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        add_bos=True,
        specials=_DEEPSEEK[1:],
        rules="every system message is gathered at the top; no generation prompt after a tool result",
    ),
    Family(
        "kimi-k2",
        KIMI_K2,
        "<|im_user|>",
        "<|im_end|>",
        specials=(
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_end|>",
            "<|tool_call_argument_begin|>",
        ),
        rules="tools declared before the system turn; call ids rewritten functions.NAME:N "
        "(list append/pop); reasoning kept after the last answer ({% break %})",
    ),
    Family(
        "minimax-m2",
        MINIMAX_M2,
        "]~b]",
        "[e~[",
        specials=("]~!b[", "<minimax:tool_call>", "</minimax:tool_call>"),
        rules="a tool result needs an assistant call before it; invoke/parameter XML calls",
    ),
    Family(
        "lfm2",
        LFM2,
        "<|im_start|>",
        "<|im_end|>",
        bos="<|startoftext|>",
        add_bos=True,
        specials=(
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
        ),
        rules="tools in the system turn; the model writes its calls in its content",
    ),
    Family(
        "nemotron",
        NEMOTRON,
        "<SPECIAL_11>",
        "<SPECIAL_12>",
        specials=("<SPECIAL_10>",),
        rules="a trailing assistant turn is rendered apart (refuses a system message alone); /think, /no_think",
    ),
    Family(
        "seed-oss",
        SEED_OSS,
        "<seed:bos>",
        "<seed:eos>",
        bos="<seed:bos>",
        specials=("<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>"),
        rules="keeps every turn's reasoning; XML calls",
    ),
    Family(
        "granite",
        GRANITE,
        "<|start_of_role|>",
        "<|end_of_text|>",
        specials=("<|end_of_role|>", "<|tool_call|>"),
        rules="the date (strftime_now) in its default system message; tools in their own turn",
    ),
    Family(
        "command-r",
        COMMAND_R,
        "<|START_OF_TURN_TOKEN|>",
        "<|END_OF_TURN_TOKEN|>",
        bos="<BOS_TOKEN>",
        add_bos=True,
        specials=(
            "<|SYSTEM_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|CHATBOT_TOKEN|>",
            "<|START_THINKING|>",
            "<|END_THINKING|>",
            "<|START_ACTION|>",
            "<|END_ACTION|>",
            "<|START_RESPONSE|>",
            "<|END_RESPONSE|>",
            "<|START_TOOL_RESULT|>",
            "<|END_TOOL_RESULT|>",
        ),
        rules="calls numbered by their order, results by the same numbers",
    ),
)


def family(name: str) -> Family:
    """The family called ``name`` (``KeyError`` naming the known ones)."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


def _digest(fam: Family, base: Path) -> str:
    h = hashlib.sha256()
    for part in (str(FAMILY_VERSION), base.name, fam.name, fam.template, fam.bos, fam.start, fam.eos):
        h.update(part.encode("utf-8") + b"\0")
    h.update(repr((fam.add_bos, fam.specials)).encode())
    return h.hexdigest()[:12]


def ensure_family_model(name: str, cache_dir: Path | None = None, base: ModelSpec | None = None) -> Path:
    """The GGUF of family ``name`` (module docstring), made from REPLY's the first time, or from
    ``base``'s (a model with REPLY's vocabulary layout: REALISTIC, for the benchmark's family
    loops, ``bench/families.py``; its embeddings are tied, so no output row is scaled and only
    the metadata differs from REALISTIC's)."""
    from filelock import FileLock

    from modeld.testmodels import REPLY, default_cache_dir, ensure_model

    fam = family(name)
    spec = REPLY if base is None else base
    directory = default_cache_dir() if cache_dir is None else Path(cache_dir)
    base_path = ensure_model(spec, directory)
    kind = "" if spec == REPLY else f"-{spec.name}"
    file_name = f"family-{fam.name}{kind}-{_digest(fam, base_path)}.gguf"
    path = directory / file_name
    if path.is_file():
        return path
    with FileLock(directory / f"{file_name}.lock"):
        if path.is_file():
            return path
        fd, tmp_name = tempfile.mkstemp(prefix=f".{file_name}.", suffix=".tmp", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _write_family(fam, base_path, tmp)
            tmp.chmod(0o644)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _write_family(fam: Family, base: Path, out: Path) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(base)
    fields = reader.fields
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"].contents())
    types: list[int] = list(fields["tokenizer.ggml.token_type"].contents())
    merges: list[str] = list(fields["tokenizer.ggml.merges"].contents())
    bos_id = int(fields["tokenizer.ggml.bos_token_id"].contents())
    eos_id = int(fields["tokenizer.ggml.eos_token_id"].contents())
    start_id = eos_id - 1  # REPLY's control tokens: <|endoftext|> (BOS), <|im_start|>, <|im_end|>
    first_merge_id = 256
    if not (bos_id == start_id - 1 == first_merge_id + len(merges)):
        raise AssertionError("the base model's vocabulary is not laid out as REPLY's")
    renamed = {start_id: fam.start, eos_id: fam.eos}
    if fam.bos and fam.bos != fam.start:
        renamed[bos_id] = fam.bos
    family_bos = start_id if fam.bos and fam.bos == fam.start else bos_id
    extra = [s for s in fam.specials if s not in renamed.values()]
    freed = list(range(bos_id - len(extra), bos_id))
    merges = merges[: len(merges) - len(extra)]
    for token_id, text in zip(freed, extra, strict=True):
        renamed[token_id] = text
    for token_id, text in renamed.items():
        tokens[token_id] = text
        types[token_id] = _CONTROL
    if len(set(tokens)) != len(tokens):
        raise AssertionError(f"family {fam.name}: a special token's text is already in the vocabulary")

    writer = gguf.GGUFWriter(out, arch=str(fields["general.architecture"].contents()))
    replaced: dict[str, Any] = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.chat_template": fam.template,
        "tokenizer.ggml.add_bos_token": fam.add_bos,
        "tokenizer.ggml.bos_token_id": family_bos,
    }
    for key, field in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = replaced.get(key, field.contents())
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    writer.add_string("modeld.testmodels.family", fam.name)
    data = {}
    for tensor in reader.tensors:
        array = tensor.data
        if tensor.name == "output.weight":
            array = np.array(array, copy=True)
            array[freed] *= _CONTROL_OUTPUT_SCALE
        data[tensor.name] = array
        writer.add_tensor_info(tensor.name, array.shape, array.dtype, array.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(data[tensor.name])
    writer.close()
