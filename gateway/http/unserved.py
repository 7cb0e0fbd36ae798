"""What a request that no route serves, or whose body is not JSON, gets: the OpenAI error shape (which the OpenAI SDK and the other
clients read), with a hint at what was probably meant, instead of FastAPI's `{"detail": "Not Found"}` or
the web demo's bare 405. The commonest mistake is an OpenAI client given the gateway without `/v1`
(`base_url="http://HOST:PORT"`): its `POST /audio/speech` is told that the API is under `/v1`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Match, Mount

from ..protocol import ErrorCode
from .routes import ApiError

API_PREFIX = "/v1"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def _methods_serving(request: Request, path: str) -> set[str]:
    """The methods some API route of the app serves at `path` (empty: no route has that path). The static
    mounts (the web demo at /, which takes any path) are not asked."""
    routes = [route for route in request.app.router.routes if not isinstance(route, Mount)]
    return {
        method for method in METHODS
        if any(route.matches({"type": "http", "path": path, "method": method, "root_path": ""})[0] is Match.FULL
               for route in routes)
    }


def unserved(request: Request) -> ApiError:
    """The error for a request that nothing serves: 405 when its path is served with other methods, else
    404."""
    method, path = request.method, request.url.path
    here = _methods_serving(request, path)
    if here and method not in here:
        return ApiError(ErrorCode.method_not_allowed,
                        f"{method} {path} is not served; {path} takes {', '.join(sorted(here))}", status=405)
    message = f"nothing is served at {method} {path}"
    under_api = API_PREFIX + path
    if not path.startswith(API_PREFIX + "/") and method in _methods_serving(request, under_api):
        message += (f"; the API is under {API_PREFIX}: {method} {under_api} (an OpenAI client's base_url ends"
                    f" in {API_PREFIX}, e.g. http://HOST:PORT{API_PREFIX})")
    else:
        message += (f"; the API is under {API_PREFIX} (POST {API_PREFIX}/audio/speech, GET {API_PREFIX}/models,"
                    f" the WebSocket at {API_PREFIX}/audio/speech/stream)")
    return ApiError(ErrorCode.not_found, message, status=404)


def is_json_media_type(content_type: str) -> bool:
    """Whether a Content-Type says JSON (application/json, or a +json type), parameters aside."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
