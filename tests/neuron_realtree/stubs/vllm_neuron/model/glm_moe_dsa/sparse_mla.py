"""STUB (real-tree mode, tests only): replaces jinhuang12/vllm-neuron ``model/glm_moe_dsa/sparse_mla.py`` @02ef711
(the selected-latent MLA decode NKI kernel: needs Neuron hardware; attention.py calls it only on a Neuron device
with GLM_ENABLE_EXPERIMENTAL_SELECTED_LATENT_MLA=1)."""

from _placeholder import Placeholder

selected_latent_mla_decode = Placeholder("glm_moe_dsa.sparse_mla.selected_latent_mla_decode")
validate_selected_latent_mla_decode_contract = Placeholder("glm_moe_dsa.sparse_mla.validate_selected_latent_mla_decode_contract")
