"""Stop requests (signals, cloud notices) and the vote that stops every rank at the same step."""
