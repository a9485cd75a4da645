"""gpuslice enforcer: per-claim GPU cores and memory limits by the strongest mechanism a GPU has.

See docs/enforcer.md.
"""

__version__ = "0.1.0"
