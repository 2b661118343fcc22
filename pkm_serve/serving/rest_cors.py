"""--rest_api_enable_cors_support: the CORS headers TF Serving's REST server adds to its
responses, and its answer to a CORS preflight (an OPTIONS request with an http(s) Origin:
200 with those headers, the request never reaching the API handler)."""
import re

from aiohttp import web

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "POST, GET",
    "Access-Control-Allow-Headers": "Content-Type",
}
_HTTP_ORIGIN = re.compile(r"https?://")


def cors_middleware(skip_path=None):
    """An aiohttp middleware adding CORS_HEADERS to every response but `skip_path`'s (the
    metrics page, which upstream serves outside its API handler)."""

    @web.middleware
    async def add_cors_headers(request, handler):
        if request.method == "OPTIONS" and _HTTP_ORIGIN.search(request.headers.get("Origin", "")):
            return web.Response(status=200, headers=CORS_HEADERS)
        response = await handler(request)
        if request.path != skip_path:
            response.headers.update(CORS_HEADERS)
        return response

    return add_cors_headers
