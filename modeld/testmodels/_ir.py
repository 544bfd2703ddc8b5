"""An OpenVINO IR directory made from a generated GGUF model (for the openvino backend's IR input).

OpenVINO GenAI converts a GGUF file to an OpenVINO model when it loads it, and with the
``enable_save_ov_model`` property it writes that model and its tokenizer/detokenizer as IR
next to the file. We do exactly that in a scratch directory and add the ``config.json`` an
optimum-intel export would carry (context length, layers, heads), so the IR directory looks like
what users bring. Needs openvino-genai at generation time; the result is cached like the GGUF.

What not: not byte-deterministic across OpenVINO versions (the exporter's output is theirs);
the cache name includes the OpenVINO GenAI version for that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from modeld.testmodels._spec import ModelSpec

__all__ = ["write_ir"]

IR_FILES = (
    "openvino_model.xml",
    "openvino_model.bin",
    "openvino_tokenizer.xml",
    "openvino_tokenizer.bin",
    "openvino_detokenizer.xml",
    "openvino_detokenizer.bin",
)


def write_ir(spec: ModelSpec, gguf: Path, target: Path) -> None:
    """Write ``spec``'s IR directory to ``target`` (which must not exist), from its GGUF file."""
    import openvino_genai

    with tempfile.TemporaryDirectory(prefix="modeld-ir-") as scratch:
        link = Path(scratch) / "model.gguf"
        os.symlink(gguf.resolve(), link)
        openvino_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            for name in IR_FILES:
                shutil.move(str(Path(scratch) / name), staging / name)
            config = {
                "_name_or_path": f"modeld-test-{spec.name}",
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "max_position_embeddings": spec.context_length,
                "num_hidden_layers": spec.layers,
                "num_attention_heads": spec.heads,
                "num_key_value_heads": spec.kv_heads,
                "hidden_size": spec.hidden,
                "head_dim": spec.hidden // spec.heads,
                "intermediate_size": spec.ff,
                "vocab_size": spec.vocab_size,
            }
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
