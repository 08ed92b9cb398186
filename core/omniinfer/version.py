__version__ = "0.1.0"

# The plugin API this core speaks (docs/conformance.md: what a platform and a backend implement).
# A plugin declares the version it was written for (`PLUGIN_API_VERSION` in its hook module): the
# same major loads; the major before loads through an adapter, with a deprecation warning, for
# one minor version (2.0 adapts 1.x, 2.1 will refuse it: platforms/legacy.py); anything else is
# refused at load.
PLUGIN_API_VERSION = "2.0"
