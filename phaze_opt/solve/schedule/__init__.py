"""The per-layer operator schedule: the fastest schedule of one layer pass on one chip.

`solver` is the entry point (cache, bounds, list schedule, MIP, branch and bound, in that order);
`verify` replays any schedule from the problem alone and shares no code with the rest.
"""
