"""Stop requests (signals, cloud notices) and the step-boundary vote that stops every
rank at the same step."""
