"""The schedules' programs (1F1B, GPipe, interleaved), their closed step forms, and the event simulator
that times a program on a placement's stage costs. The planner's ground floor: imports no other wing."""
