"""--rest_api_enable_cors_support: the CORS headers TF Serving's REST server adds to the
answers of its API handler (every /v1/ path), and its answer to a CORS preflight there (an
OPTIONS request with an http(s) Origin: 200 with those headers, the request never reaching
the handler). Other paths have no handler upstream: their 404 carries no CORS headers."""
import re

from aiohttp import web

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "POST, GET",
    "Access-Control-Allow-Headers": "Content-Type",
}
_HTTP_ORIGIN = re.compile(r"https?://")


def cors_middleware(skip_path=None):
    """An aiohttp middleware adding CORS_HEADERS to the answers of /v1/ paths but
    `skip_path`'s (the metrics page, which upstream serves outside its API handler)."""

    @web.middleware
    async def add_cors_headers(request, handler):
        api = request.path.lower().startswith("/v1/") and request.path != skip_path
        if api and request.method == "OPTIONS" and _HTTP_ORIGIN.search(request.headers.get("Origin", "")):
            return web.Response(status=200, headers=CORS_HEADERS)
        response = await handler(request)
        if api:
            response.headers.update(CORS_HEADERS)
        return response

    return add_cors_headers
