"""STAND-IN: the model-loading sequence of vllm-neuron's NeuronModelRunner.load_model (upstream
vllm_neuron/vllm/worker/neuron_model_runner.py @9fc042ea), in its order:

1. build on the meta device: ``with torch.device("meta"): model_cls.from_configs(hf_config, neuron_config)``;
2. ``model.load_weights(path, device, download_dir)`` (its SafetensorsCheckpoint loads on a 4-thread pool with
   a lazy per-shard index), then ``model.to(device)``; or, with ``VLLM_NEURON_CPU_COMPILE``,
   ``model.load_weights_lite(path, cpu, download_dir)`` when the model has it, then ``model.to("meta")``;
3. ``torch._dynamo.config.cache_size_limit = 2**62`` and ``torch.compile(model, backend=..., fullgraph=True)``
   (upstream's backend is vllm-neuron's; here "eager", or the caller's: the trace is what is checked).
The decode / prefill calls are the caller's (``model(...)``). ``compile=False`` stops after step 2 (tests that
look at loaded weights only)."""

import os

import torch


def load_model(model_cls, hf_config, neuron_config, model_path, device="cpu", download_dir=None, *, compile=True,
               backend="eager", cpu_compile=None):
    cpu_compile = bool(os.environ.get("VLLM_NEURON_CPU_COMPILE")) if cpu_compile is None else cpu_compile
    with torch.device("meta"):
        model = model_cls.from_configs(hf_config, neuron_config)
    if not cpu_compile:
        model.load_weights(model_path, torch.device(device), download_dir)
        model = model.to(device)
    else:
        if hasattr(model, "load_weights_lite"):
            model.load_weights_lite(model_path, torch.device("cpu"), download_dir)
        model = model.to("meta")
    if not compile:
        return model
    torch._dynamo.config.cache_size_limit = 2**62
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
