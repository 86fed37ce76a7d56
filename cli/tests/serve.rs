//! The HTTP server over real loopback connections, driven by the `openai` Python client and
//! raw requests (httpx): `cli/tests/serve/test_serve.py`, run with pytest. The Python packages
//! come from PyPI through `scripts/install-py-test-deps.sh` (pinned, into `.tools/py`).

mod http;

#[test]
fn openai_compatible_api_over_http() {
    http::pytest(&[], &[]);
}
