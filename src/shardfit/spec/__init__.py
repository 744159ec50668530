"""The first stage of the flow: what is trained (ModelSpec), how, and on what (Plan, GPU catalog)."""
