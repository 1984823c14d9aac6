"""What steps cost: the clock the step loops mark, the step log `meshserve diagnose`
reads, and the cost model's priors for the step budget and the speculation switch.

May import: engine.core, engine.config, parallel.planner.
"""
