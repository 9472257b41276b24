"""The JavaScript side of web training: gradbuilder-train.mjs and the web demo's page (data files)."""
