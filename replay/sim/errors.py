"""Error bodies shaped like the servers the sim stands in for.

vLLM (vllm/entrypoints/openai/protocol.py ErrorResponse/ErrorInfo):
``{"error": {"message", "type", "param", "code": <HTTP status>}}``; a request naming
another model gets 404 NotFoundError ("The model `x` does not exist."). TGI
(router/src/lib.rs ErrorResponse): ``{"error": "...", "error_type": "validation"}`` with 422.
"""

from __future__ import annotations

import orjson

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    429: "TooManyRequests",
    500: "InternalServerError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


class ApiError(Exception):
    """A request the sim refuses, with the status and the field to blame."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or ERROR_TYPES.get(status, "Error")

    def openai_body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}
        )

    def tgi_body(self) -> bytes:
        kind = "validation" if self.status in (400, 422) else "generation" if self.status >= 500 else "error"
        return orjson.dumps({"error": self.message, "error_type": kind})


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> ApiError:
    """vLLM's wording for a prompt that does not fit (serving_engine._validate_input)."""
    if max_tokens is None:
        return ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="messages",
        )
    return ApiError(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
        f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
        f"({max_tokens} > {max_model_len} - {prompt_tokens}).",
        param="max_tokens",
    )
