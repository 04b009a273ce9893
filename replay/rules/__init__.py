"""Rules every stage shares (synth, sim, dispatch, results), in modules that import none of them.

A rule stated once here cannot drift between the stage that produces a figure and the stage
that checks it: the prefix-cache hit rule is what the sim reports and what results/fidelity.py
predicts; the special-token rule is how synth counts and how the sim encodes.
"""
