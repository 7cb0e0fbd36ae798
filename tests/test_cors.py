"""Pages of other origins use the gateway's HTTP API and JavaScript client: CORS headers for the origins the
gateway allows (`--allowed-origin`; loopback pages without API keys), preflights answered, in Chromium
from a second loopback origin. Before, /clients/js/voxgate.js had no Access-Control-Allow-Origin and
`OPTIONS /v1/audio/speech` answered 405, so only the WebSocket worked."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway_server import running_gateway
from tests.js_fixtures import (
    JS_CLIENT_DIR, require_chromium, require_node, require_npm_packages, run_node_json, static_site,
)

KEY = "k-cors-test"

# Every way a page of another origin uses the gateway, each in its own try, so one refusal does not hide
# the others; the page puts what it got in window.corsResult.
PAGE = """<!doctype html>
<script type="module">
const gateway = "GATEWAY", key = "KEY", auth = { Authorization: `Bearer ${key}` }, result = {};
const attempt = async (name, work) => {
  try { result[name] = await work(); } catch (error) { result[name] = `failed: ${error}`; }
};
await attempt("module", async () => {
  const { VoxgateClient } = await import(`${gateway}/clients/js/voxgate.js`);
  window.VoxgateClient = VoxgateClient;
  return "loaded";
});
await attempt("speech", async () => {
  const response = await fetch(`${gateway}/v1/audio/speech`, {
    method: "POST", headers: { ...auth, "Content-Type": "application/json" },
    body: JSON.stringify({ input: "Hello from another origin.", voice: "tone-mid", response_format: "pcm" }),
  });
  return { status: response.status, bytes: (await response.arrayBuffer()).byteLength,
           sampleRate: response.headers.get("X-Sample-Rate") };
});
await attempt("refused", async () => {
  const response = await fetch(`${gateway}/v1/audio/speech`, {
    method: "POST", headers: { Authorization: "Bearer wrong", "Content-Type": "application/json" },
    body: JSON.stringify({ input: "Hi.", voice: "tone-mid" }),
  });
  return { status: response.status, code: (await response.json()).error.code };
});
await attempt("voices", async () => (await fetch(`${gateway}/v1/audio/voices`, { headers: auth })).status);
await attempt("socket", async () => {
  const client = await window.VoxgateClient.connect(gateway, { voice: "tone-mid", apiKey: key });
  const spoken = await client.speak("Hi there.");
  client.close();
  return spoken.bytes;
});
window.corsResult = result;
</script>
"""


@pytest.fixture
def browser_parts():
    require_node()
    require_npm_packages()
    require_chromium()


def test_a_page_of_an_allowed_origin_uses_the_http_api_the_module_and_the_socket(tmp_path, browser_parts):
    # Two sites on loopback ports of their own, one of them allowed; the same page on both.
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    with static_site(allowed) as allowed_site, static_site(other) as other_site:
        with running_gateway("synthetic", api_keys=[KEY], allowed_origins=[allowed_site]) as server:
            for folder in (allowed, other):
                folder.mkdir()
                (folder / "page.html").write_text(PAGE.replace("GATEWAY", server.url).replace("KEY", KEY))
            seen = run_node_json(JS_CLIENT_DIR / "test" / "cors_page.mjs", allowed_site + "/page.html")
            refused = run_node_json(JS_CLIENT_DIR / "test" / "cors_page.mjs", other_site + "/page.html")
    assert seen.get("failure") is None and seen["pageErrors"] == [], seen
    result = seen["result"]
    assert result["module"] == "loaded", seen
    assert result["speech"]["status"] == 200 and result["speech"]["bytes"] > 10_000, seen
    assert result["speech"]["sampleRate"] == "24000", seen  # an exposed header
    assert result["refused"] == {"status": 401, "code": "unauthorized"}, seen  # the page reads the refusal
    assert result["voices"] == 200, seen
    assert result["socket"] > 0, seen
    # A site not on the list gets nothing: the browser blocks the module and every fetch.
    other_result = refused["result"]
    assert other_result["module"].startswith("failed"), refused
    assert other_result["speech"].startswith("failed") and other_result["voices"].startswith("failed"), refused


def test_preflights_and_headers_follow_the_origin_policy():
    site, elsewhere = "http://127.0.0.1:8080", "https://elsewhere.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    with running_gateway("synthetic", api_keys=[KEY], allowed_origins=[site]) as server:
        answer = httpx.options(server.url + "/v1/audio/speech", headers={"Origin": site, **preflight})
        assert answer.status_code == 200, answer.text
        assert answer.headers["Access-Control-Allow-Origin"] == site
        assert "POST" in answer.headers["Access-Control-Allow-Methods"]
        assert answer.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        refused = httpx.options(server.url + "/v1/audio/speech", headers={"Origin": elsewhere, **preflight})
        assert refused.status_code == 400 and "Access-Control-Allow-Origin" not in refused.headers
        script = httpx.get(server.url + "/clients/js/voxgate.js", headers={"Origin": site})
        assert script.status_code == 200 and script.headers["Access-Control-Allow-Origin"] == site
        assert "Origin" in script.headers["Vary"]
        other = httpx.get(server.url + "/clients/js/voxgate.js", headers={"Origin": elsewhere})
        assert "Access-Control-Allow-Origin" not in other.headers
        health = httpx.get(server.url + "/health", headers={"Origin": site})
        assert "Access-Control-Allow-Origin" not in health.headers  # only the API and the client
    with running_gateway("synthetic") as server:  # no keys, no list: loopback pages, as the WebSocket admits
        local = httpx.options(server.url + "/v1/audio/speech",
                              headers={"Origin": "http://localhost:5173", **preflight})
        assert local.status_code == 200 and local.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
        remote = httpx.options(server.url + "/v1/audio/speech", headers={"Origin": elsewhere, **preflight})
        assert remote.status_code == 400
