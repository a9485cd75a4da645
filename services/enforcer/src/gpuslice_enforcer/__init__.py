"""gpuslice enforcer: per-claim GPU cores and memory limits by the strongest mechanism a GPU has.

See docs/enforcer.md.
"""
