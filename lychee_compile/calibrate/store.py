"""The calibration folder's resume file (state.json): the settings it was made with and every finished piece
(head scores, dense reference records, each searched point, each certification's records so far), written
atomically after each piece. A second run with the same folder and settings reuses them; other settings are refused.
"""
from __future__ import annotations

import json
import os


class Store:
    FILE = "state.json"

    def __init__(self, out_dir: str, settings: dict, aliases: dict | None = None):
        """aliases: {setting: other values that mean the same}, e.g. the model's legacy fingerprint, under which a
        folder made before is resumed (and its settings rewritten to the current value)."""
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, self.FILE)
        self.settings = json.loads(json.dumps(settings))     # as JSON keeps it (tuples -> lists)
        self.data = {"settings": self.settings, "pieces": {}}
        if os.path.exists(self.path):
            with open(self.path) as f:
                old = json.load(f)
            for key, same in (aliases or {}).items():
                if old["settings"].get(key) in same:
                    old["settings"][key] = self.settings.get(key)
            if old["settings"] != self.settings:
                diff = sorted(k for k in set(old["settings"]) | set(self.settings)
                              if old["settings"].get(k) != self.settings.get(k))
                raise ValueError(f"{self.path} was made with other settings ({', '.join(diff)} differ); use another "
                                 "output folder, or the same settings to resume")
            self.data = old

    def get(self, key: str):
        return self.data["pieces"].get(key)

    def put(self, key: str, value) -> None:
        self.data["pieces"][key] = value
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f)
        os.replace(self.path + ".tmp", self.path)
