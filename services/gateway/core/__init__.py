"""What the gateway's three APIs share: the request core (an ``Ask`` placed and answered), the
generation client and its pure stream state, where deployments run, tokenizers, the guards every
request passes (keys, rates, body size, concurrency), the error shapes, and the metrics."""
