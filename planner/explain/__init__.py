"""What a person reads beside the plan: the baselines it is compared with, bottlenecks, why a plan does not
fit, caveats, link advice, and the verdict's sentences. Imports the wings below it."""
