"""STAND-IN: the model-loading sequence of vllm-neuron's NeuronModelRunner.load_model (upstream
vllm_neuron/vllm/worker/neuron_model_runner.py @9fc042ea): resolve the class, build it on the meta
device with from_configs(hf_config, neuron_config), load_weights(path, device, download_dir), .to(device)."""

import torch


def load_model(model_cls, hf_config, neuron_config, model_path, device="cpu", download_dir=None):
    with torch.device("meta"):
        model = model_cls.from_configs(hf_config, neuron_config)
    model.load_weights(model_path, torch.device(device), download_dir)
    return model.to(device)
