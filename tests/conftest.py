"""Suite-wide settings. Area fixtures live in tests/<area>_fixtures.py or helper modules beside the tests."""

import os

# CI sets CI=true: tests that need an external part (Chromium, Redis, a reference venv) must fail there
# rather than skip when the part is missing.
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
