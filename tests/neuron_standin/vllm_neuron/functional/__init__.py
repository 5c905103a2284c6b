"""STAND-IN: vllm_neuron/functional (only the MoE router the GLM-5.3 stand-in calls: ``moe/router.py``)."""
