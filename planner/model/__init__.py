"""What a placement costs: the cost table, the cost models (datasheets, measured profiles), links, streaming
from host RAM, the objective, state copies, and a placement's prediction. Imports schedule/ only."""
