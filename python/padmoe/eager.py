"""Deprecated name of :mod:`padmoe.reference` (removed in the next release)."""

import sys
import warnings

from padmoe import reference as _reference

warnings.warn("padmoe.eager is deprecated: import padmoe.reference", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _reference
