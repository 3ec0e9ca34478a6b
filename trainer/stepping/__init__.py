"""A step: connect() and its facade, a step's attempts, the exchange variants and the Step call."""
