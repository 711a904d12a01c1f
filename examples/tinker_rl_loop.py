"""RL with the `tinker` SDK against `marlaas serve`: a LoRA adapter of the embedded base
learns to reverse words; its final weights are saved and called through the
OpenAI-compatible API.

Start the server, make a tenant and a `tml-` key for it (the admin key is printed at
the server's first start, or set MARLAAS_ADMIN_KEY), point the SDK at the server:

    marlaas serve &
    curl -s -X POST http://127.0.0.1:8321/v1/admin/tenants \\
        -H "Authorization: Bearer $MARLAAS_ADMIN_KEY" -d '{"name": "me"}'
    export TINKER_API_KEY=$(curl -s -X POST http://127.0.0.1:8321/v1/admin/tenants/me/keys \\
        -H "Authorization: Bearer $MARLAAS_ADMIN_KEY" -d '{"format": "tml"}' | jq -r .key)
    export TINKER_BASE_URL=http://127.0.0.1:8321
    python examples/tinker_rl_loop.py --steps 20

The loop (`marlaas.bench.tinker_loop.run_loop`) is plain SDK code: sample groups from
the current weights (`save_weights_and_get_sampling_client`), score them, centre the
rewards, one `forward_backward` with a policy loss and one `optim_step` per step. Run
several copies at once (other tenants, or the same one): marlaas serves them in shared
batches on one base.
"""

from __future__ import annotations

import argparse
import os

import httpx
import tinker

from marlaas.bench.tinker_loop import LoopConfig, run_loop


def main() -> None:
    parser = argparse.ArgumentParser(description="RL with the tinker SDK on marlaas serve.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument(
        "--loss", default="importance_sampling", choices=["importance_sampling", "ppo", "cispo"]
    )
    parser.add_argument("--save-as", default="reverse-final", help="Name of the saved weights.")
    args = parser.parse_args()
    url, key = os.environ.get("TINKER_BASE_URL"), os.environ.get("TINKER_API_KEY")
    if not url or not key:
        parser.error("set TINKER_BASE_URL and TINKER_API_KEY (a tml- key of your tenant)")

    # The server names the base it trains: the embedded one, or its --base-model.
    capabilities = tinker.RestClient().get_server_capabilities().result()
    base = str(capabilities.supported_models[0].model_name)
    print(f"base model: {base}")

    service = tinker.ServiceClient()
    config = LoopConfig(
        steps=args.steps, learning_rate=args.learning_rate, rank=args.rank, loss_fn=args.loss
    )
    result = run_loop(service, base, config, log=print, save_as=args.save_as)
    service.close("success").result()
    print(
        f"greedy accuracy on held-out words: {result.accuracy_before:.3f} -> "
        f"{result.accuracy_after:.3f} in {result.seconds:.0f} s; saved as {result.saved_path}"
    )

    # The saved weights are an ordinary model of your tenant on the OpenAI-compatible API.
    answer = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": result.saved_path,
            "prompt": "Q: reverse marlaas\nA: ",
            "max_tokens": 12,
            "temperature": 0,
            "stop": ["\n"],
        },
        timeout=60,
    )
    answer.raise_for_status()
    print(f"reverse marlaas -> {answer.json()['choices'][0]['text']!r}")


if __name__ == "__main__":
    main()
