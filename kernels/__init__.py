"""omni's attention kernels: Triton kernels and their torch references.

    kernels.dispatch        store_kv / paged_attention with backend choice (torch | triton)
    kernels.reference       torch implementations: the CPU path and the test oracle
    kernels.store_kv        Triton: write new K/V rows into the paged cache
    kernels.paged_attention Triton: varlen causal attention over the paged cache
    kernels.tuned           launch configurations tuned per GPU (kernels/configs/)

Imports nothing of omni or stages. Importing the package imports neither
torch nor triton; import the module you need.
"""
