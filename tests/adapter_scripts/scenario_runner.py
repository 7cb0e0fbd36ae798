"""What the scenario scripts share: the command line, running a plan, and LLM-style tokens.

    python <framework>_scenarios.py WS_URL PLAN_JSON

PLAN_JSON maps scenario names to their keyword arguments (a `gateway_url` among them sends that scenario to
another gateway). The script prints one line, `RESULTS <json>`: scenario name -> observations, or
{"error": traceback}; the pytest side asserts on them. Imported from the scripts' own folder (it is first on
sys.path when a script runs), so it works in every framework's venv.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import traceback
from collections.abc import Awaitable, Callable


def llm_tokens(text: str) -> list[str]:
    """Split text the way an LLM streams it: words with their leading space, punctuation on its own."""
    return re.findall(r"\s*[^\s.,!?;:]+|[.,!?;:]", text)


async def _run_plan(scenarios: dict[str, Callable[..., Awaitable[dict]]], url: str, plan: dict) -> dict:
    results = {}
    for name, kwargs in plan.items():
        try:
            target = kwargs.pop("gateway_url", url)  # a scenario may need a differently configured gateway
            results[name] = await asyncio.wait_for(scenarios[name](target, **kwargs), 60)
        except BaseException:
            results[name] = {"error": traceback.format_exc()}
    return results


def main(scenarios: dict[str, Callable[..., Awaitable[dict]]]) -> None:
    url, plan = sys.argv[1], json.loads(sys.argv[2])
    print("RESULTS " + json.dumps(asyncio.run(_run_plan(scenarios, url, plan))))
