"""Pure facts and decisions: typed state, inventory, model facts, placement, errors."""
