"""The NAM56R model: its config and presets, the layer pattern and specs, the mixers, experts and embedding,
the parameter count and the FLOP formula. The only package that knows the model."""
