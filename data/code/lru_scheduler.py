"""An LRU cache with a byte budget, and a tiny job scheduler that uses it.

Run this file to check it.
"""

import heapq
from collections import OrderedDict


class LRUCache:
    """Keeps the most recently used items within a size budget."""

    def __init__(self, budget):
        if budget <= 0:
            raise ValueError("budget must be positive")
        self.budget = budget
        self.used = 0
        self.items = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self):
        return len(self.items)

    def __contains__(self, key):
        return key in self.items

    def get(self, key, default=None):
        if key not in self.items:
            self.misses += 1
            return default
        self.hits += 1
        self.items.move_to_end(key)
        return self.items[key][0]

    def put(self, key, value, size=1):
        if size > self.budget:
            raise ValueError("item larger than budget")
        if key in self.items:
            self.used -= self.items.pop(key)[1]
        self.items[key] = (value, size)
        self.used += size
        return self.evict()

    def evict(self):
        gone = []
        while self.used > self.budget:
            key, (_, size) = self.items.popitem(last=False)
            self.used -= size
            gone.append(key)
        return gone

    def remove(self, key):
        value, size = self.items.pop(key)
        self.used -= size
        return value

    def hit_rate(self):
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def resize(self, budget):
        if budget <= 0:
            raise ValueError("budget must be positive")
        self.budget = budget
        return self.evict()

    def stats(self):
        return {
            "items": len(self.items),
            "used": self.used,
            "budget": self.budget,
            "hit_rate": round(self.hit_rate(), 3),
        }


class Job:
    """A unit of work with a priority and the keys it reads."""

    def __init__(self, name, priority, reads, cost=1):
        self.name = name
        self.priority = priority
        self.reads = list(reads)
        self.cost = cost
        self.done = False

    def __repr__(self):
        return f"Job({self.name!r}, p={self.priority})"


class Scheduler:
    """Runs jobs by priority; ties go to the job whose data is cached."""

    def __init__(self, cache, loader):
        self.cache = cache
        self.loader = loader
        self.queue = []
        self.counter = 0
        self.log = []
        self.clock = 0

    def submit(self, job):
        self.counter += 1
        heapq.heappush(self.queue, (-job.priority, self.counter, job))

    def pending(self):
        return [entry[2] for entry in sorted(self.queue)]

    def warm(self, job):
        return sum(key in self.cache for key in job.reads)

    def pick(self):
        if not self.queue:
            return None
        top = self.queue[0][0]
        ties = [e for e in self.queue if e[0] == top]
        best = max(ties, key=lambda e: (self.warm(e[2]), -e[1]))
        self.queue.remove(best)
        heapq.heapify(self.queue)
        return best[2]

    def load(self, key):
        value = self.cache.get(key)
        if value is None:
            value, size = self.loader(key)
            self.cache.put(key, value, size)
            self.clock += size
        return value

    def run_one(self):
        job = self.pick()
        if job is None:
            return None
        data = [self.load(key) for key in job.reads]
        self.clock += job.cost
        job.done = True
        self.log.append((self.clock, job.name, len(data)))
        return job

    def run_all(self):
        finished = []
        while self.queue:
            finished.append(self.run_one())
        return finished


def size_of(value):
    """A rough size: characters for text, 8 per number, summed for lists."""
    if isinstance(value, str):
        return max(1, len(value))
    if isinstance(value, (int, float)):
        return 8
    if isinstance(value, (list, tuple)):
        return sum(size_of(v) for v in value) or 1
    raise TypeError(f"cannot size {type(value).__name__}")


def make_loader(store):
    def loader(key):
        value = store[key]
        return value, size_of(value)

    return loader


def _check_cache():
    c = LRUCache(3)
    c.put("a", 1)
    c.put("b", 2)
    c.put("c", 3)
    assert c.get("a") == 1
    assert c.put("d", 4) == ["b"]
    assert "b" not in c and len(c) == 3
    assert c.put("big", 0, size=2) == ["c", "a"]
    assert c.used == 3
    assert c.get("zzz", "none") == "none"
    assert 0 < c.hit_rate() < 1
    assert c.resize(2) == ["d"]
    assert c.stats()["used"] == 2
    try:
        c.put("huge", 0, size=4)
    except ValueError:
        pass
    else:
        raise AssertionError("oversized item accepted")


def _check_scheduler():
    store = {"x": "abcd", "y": [1, 2], "z": 7.5}
    sched = Scheduler(LRUCache(20), make_loader(store))
    sched.submit(Job("low", 1, ["x"]))
    sched.submit(Job("high", 5, ["y"]))
    sched.submit(Job("tie-cold", 3, ["z"]))
    sched.submit(Job("tie-warm", 3, ["y"]))
    order = [job.name for job in sched.run_all()]
    assert order == ["high", "tie-warm", "tie-cold", "low"]
    assert sched.cache.used == 8 + 4 and "y" not in sched.cache
    assert sched.clock > 0 and len(sched.log) == 4
    assert sched.pick() is None


if __name__ == "__main__":
    _check_cache()
    _check_scheduler()
    print("lru_scheduler: all checks passed")
