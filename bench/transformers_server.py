"""The seed's serving shape, as the baseline of bench/serve_load.py: FastAPI + transformers'
`generate`, one request at a time (the seed's `async def` endpoint calls the blocking generate
on the event loop), greedy, answering only the new tokens as `mcore-rl serve`'s /generate does.

    python bench/transformers_server.py MODEL_FOLDER --port 8001 [--dtype bfloat16]
"""

import argparse

import torch
import transformers
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class GenerateRequest(BaseModel):
    prompt: str
    max_tokens: int = 64


def build_app(folder: str, dtype: torch.dtype) -> FastAPI:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/generate")
    async def generate(request: GenerateRequest):
        inputs = tokenizer(request.prompt, return_tensors="pt").to(device)
        with torch.no_grad():
            outputs = model.generate(**inputs, max_new_tokens=request.max_tokens, do_sample=False)
        new_tokens = outputs[0, inputs["input_ids"].shape[1]:]
        return {"response": tokenizer.decode(new_tokens, skip_special_tokens=True)}

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    uvicorn.run(build_app(args.model, getattr(torch, args.dtype)), host="127.0.0.1", port=args.port, log_level="warning")
