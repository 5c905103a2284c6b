"""The exact twin (:func:`write_twin`): a checkpoint with every FP8 weight replaced by its exactly
dequantised value and no ``quantization_config``, the independent reference vLLM runs unquantised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vllm_moe_w8.tiny_models.quantize import dequantize_exact
from vllm_moe_w8.tiny_models.shards import load_all, write_shards

def write_twin(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Copy ``src`` to ``dst`` with every FP8 weight exactly dequantised to ``dtype`` and no quantization_config.

    fp32 twins are exact for bf16/fp16 scales (a 4-bit x 8/11-bit mantissa product fits fp32) and
    correctly rounded to fp32 for fp32 scales (GLM); bf16 twins round that fp32 product to bf16.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"twin dtype must be float32, bfloat16 or float16, got {dtype}")
    config = json.loads((src / "config.json").read_text())
    qcfg = config.pop("quantization_config", None) or config.get("text_config", {}).pop("quantization_config", None)
    if qcfg is None:
        raise ValueError(f"{src / 'config.json'} has no quantization_config: not an FP8 checkpoint")
    block = tuple(qcfg["weight_block_size"]) if qcfg.get("quant_method") == "fp8" else None
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_all(src)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv") or name.endswith("_scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale"))
            if scale is None:
                raise ValueError(f"FP8 tensor {name!r} in {src} has no weight_scale_inv / weight_scale")
            out[name] = dequantize_exact(t, scale, block).to(dtype)
        else:
            out[name] = t
    num_shards = len(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()))
    write_shards(dst, out, num_shards)
    dtype_name = str(dtype).removeprefix("torch.")
    for cfg in (config, config.get("text_config")):
        if cfg is not None:
            for key in ("torch_dtype", "dtype"):
                if key in cfg:
                    cfg[key] = dtype_name
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix == ".json" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dst
