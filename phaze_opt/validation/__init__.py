"""Validation data: published training runs and measured layer times to compare the models against.

- `suites.load_suite(name_or_path) -> Suite`: a validated suite from `configs/validation/<name>.yaml`;
- `suites.list_suites()`: the shipped suites' names;
- `suites.iteration_flops(formula, model, batch)`: the FLOP count a suite's published numbers use;
- `measure.measure(model, tp, mbs, device=...)`: per-layer truth made on the user's own device (the
  traced block materialised and timed), in the form a layer suite reads as its data.

Pure data: loading a suite reads YAML/JSON and the model, arch and system configs it names, nothing else.
Only `measure` runs anything (torch on a real device).
"""
