"""`draftwise bench`: the same prompts through draftwise and its peers, in one process."""
