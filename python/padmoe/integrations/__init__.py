"""Integrations of padmoe with other libraries.

- :mod:`padmoe.integrations.transformers`: a "padmoe" experts implementation for Hugging Face
  transformers (``model.set_experts_implementation("padmoe")``); see docs/transformers.md.

Each integration imports its library only when it is imported itself.
"""
