"""tracereplay: replay production LLM request traces against LLM servers, on Locust.

The version is the installed distribution's (`replay --version`, importlib.metadata), from
pyproject.toml alone."""
