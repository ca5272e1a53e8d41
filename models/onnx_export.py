"""Export a Hugging Face causal LM to ONNX the way infeng's ONNX frontend expects: torch's dynamo
exporter, batch 1, dynamic sequence length, no KV cache, full-sequence logits (one output).

    python -m infeng_models.onnx_export ./stories260K stories.onnx

Needs torch, transformers and onnxscript (the ``test`` extra). The TorchScript exporter fails on
transformers 5's mask code, so ``dynamo=True`` is used.
"""
from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path


def export_onnx(model_dir: str | Path, out: str | Path, probe_length: int = 8) -> Path:
    import torch
    import transformers

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class LogitsOnly(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    ids = torch.randint(0, model.config.vocab_size, (1, probe_length))
    seq = torch.export.Dim("seq", min=2, max=4096)
    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        torch.onnx.export(LogitsOnly(model).eval(), (ids,), str(out), dynamo=True, external_data=True,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_shapes={"input_ids": {1: seq}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    args = ap.parse_args()
    print(export_onnx(args.model_dir, args.out))


if __name__ == "__main__":
    main()
