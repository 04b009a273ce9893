"""tracereplay: replay production LLM request traces against LLM servers, on Locust."""

__version__ = "0.1.0"
