"""The driver: engine, schedulers, block managers, sequences, stop rules, detokenizer, outputs,
`ForwardMode` and the planner that turns a scheduled batch into a `StepPlan`."""
