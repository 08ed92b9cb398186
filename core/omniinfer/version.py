__version__ = "0.1.0"

# The plugin API this core speaks. A plugin declares the version it was written for
# (`PLUGIN_API_VERSION` in its hook module); a different major version is refused at load.
PLUGIN_API_VERSION = "1.0"
