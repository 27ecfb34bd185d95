"""Global save plans: dedup and balance across ranks, the plan cache, the metadata a plan produces, and
the offline simulator.
"""
