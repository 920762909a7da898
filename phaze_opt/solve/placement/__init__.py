"""The device placement: pipeline stages, TP/CP/EP widths and data-parallel degree for one design.

`expert.optimal_placement` is the entry point (it hands problems without EP or CP to the dense DP
in `dp`); `evaluate` prices any given placement independently and shares no code with the DPs.
"""
