"""Locust users for `mcore-rl serve` and the baseline (bench/serve_load.py runs it headless).

    locust -f bench/locustfile.py --headless -u 50 -r 5 -t 60s -H http://127.0.0.1:8000

Each user posts the seed's request, `POST /generate {"prompt": ...}`, back to back (no think
time), with a prompt drawn from SERVE_LOAD_PROMPTS (a JSON list; default: a quickstart
question). SERVE_LOAD_MAX_TOKENS caps the response; SERVE_LOAD_API_KEY is sent as a bearer
token when set.
"""

import json
import os
import random

from locust import HttpUser, task

PROMPTS = json.loads(os.environ.get("SERVE_LOAD_PROMPTS", '["max 3 8 1"]'))
MAX_TOKENS = int(os.environ.get("SERVE_LOAD_MAX_TOKENS", "16"))
API_KEY = os.environ.get("SERVE_LOAD_API_KEY")


class GenerateUser(HttpUser):
    @task
    def generate(self):
        headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
        with self.client.post("/generate", json={"prompt": random.choice(PROMPTS),
                                                 "max_tokens": MAX_TOKENS},
                              headers=headers, catch_response=True) as response:
            if response.status_code != 200 or "response" not in response.json():
                response.failure(f"{response.status_code}: {response.text[:200]}")
