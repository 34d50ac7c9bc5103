// The leasekeeper console's only script: remaining ttls ticking down and refreshed from the
// service, live updates (Server-Sent Events), and forms that cannot be sent twice. It never
// builds HTML from data: every value goes in with textContent.
"use strict";

(function () {
  const loaded = performance.now();
  const REFRESH_MS = 2500; // the shown tasks' remaining ttls are asked for this often
  const LIVE_MARGIN_MS = 250;

  // --- remaining ttl: data-expire holds the seconds left when the value was set ---------
  function tick() {
    const now = performance.now();
    for (const el of document.querySelectorAll("[data-expire]")) {
      const base = el.dataset.base ? Number(el.dataset.base) : loaded;
      const left = Number(el.dataset.expire) - (now - base) / 1000;
      el.textContent = left > 0 ? left.toFixed(1) + " s" : "0.0 s (expiry due)";
      el.classList.toggle("muted", left <= 0);
    }
  }
  tick();
  setInterval(tick, 250);

  // --- a confirmation (or any action form) is sent once ---------------------------------
  for (const form of document.querySelectorAll("form[method=post]")) {
    form.addEventListener("submit", function () {
      // After this event, so the clicked button's name and value are still sent.
      setTimeout(function () {
        for (const button of form.querySelectorAll("button[type=submit]")) {
          button.disabled = true;
        }
      }, 0);
    });
  }

  // A page shown again from the back/forward cache gets its buttons back.
  window.addEventListener("pageshow", function () {
    for (const button of document.querySelectorAll("form[method=post] button[type=submit]")) {
      button.disabled = false;
    }
  });

  // --- a task's cells ---------------------------------------------------------------------
  const status = document.getElementById("live-status");

  function say(text, ok) {
    status.hidden = false;
    status.textContent = text;
    status.classList.toggle("ok", Boolean(ok));
  }

  function setCell(scope, column, value) {
    const el = scope.querySelector('[data-col="' + column + '"]');
    if (el) {
      el.textContent = value;
    }
    return el;
  }

  function setCountdown(scope, seconds) {
    const el = scope.querySelector('[data-testid="ttl-countdown"]');
    if (!el) {
      return;
    }
    if (seconds === null || seconds === undefined) {
      delete el.dataset.expire;
      el.textContent = "—";
      el.classList.add("muted");
    } else {
      el.dataset.expire = String(seconds);
      el.dataset.base = String(performance.now());
      el.classList.remove("muted");
      tick();
    }
  }

  function apply(scope, task) {
    const state = setCell(scope, "state", task.state);
    if (state) {
      state.className = "state state-" + task.state;
    }
    const ownerLabel = scope.querySelector("[data-owner-label]");
    if (ownerLabel) {
      ownerLabel.textContent = task.state === "HELD" ? "Owner" : "Last owner";
    }
    setCell(scope, "owner_id", task.owner_id || "—");
    setCell(scope, "fence", String(task.fence));
    setCell(scope, "attempts", task.max_attempts ? task.attempts + " / " + task.max_attempts : String(task.attempts));
    setCell(scope, "checkpoint_version", task.checkpoint_version ? String(task.checkpoint_version) : "—");
    if ("expire_time" in task) {
      setCell(scope, "expire_time", task.expire_time || "—");
    }
    setCountdown(scope, task.remaining_ttl);
  }

  function flash(scope) {
    const row = scope.closest("tr") || scope;
    row.classList.remove("flash");
    void row.offsetWidth; // restart the animation
    row.classList.add("flash");
  }

  function scopeOf(taskId) {
    for (const el of document.querySelectorAll("[data-task-id]")) {
      if (el.dataset.taskId === taskId) {
        return el;
      }
    }
    return null;
  }

  // When each task last changed by a live update (performance.now()): a refresh answer
  // older than that is not applied to it.
  const liveAt = new Map();

  // --- remaining ttls from the service: renewals are not live-update events ----------------
  // Every REFRESH_MS while the tab is visible, ask /leases.json for the shown tasks' state
  // and remaining ttl (database clock), and set them.
  const refresh = document.body.dataset.refresh;
  if (refresh && window.fetch) {
    let busy = false;
    let stopped = false;

    const poll = async function () {
      if (busy || stopped || document.visibilityState !== "visible") {
        return;
      }
      busy = true;
      const sent = performance.now();
      try {
        const response = await fetch(refresh, {
          credentials: "same-origin",
          cache: "no-store",
          headers: { accept: "application/json" },
        });
        const body = await response.json();
        if (!response.ok) {
          stopped = true;
          say("Remaining ttls are no longer refreshed: " + (body.error || "HTTP " + response.status) + " Reload to try again.");
          return;
        }
        const asOf = sent - body.age_s * 1000; // when the service was asked, at the latest
        for (const task of body.tasks) {
          const scope = scopeOf(task.task_id);
          const live = liveAt.get(task.task_id);
          if (scope && (live === undefined || live < asOf - LIVE_MARGIN_MS)) {
            apply(scope, task);
          }
        }
      } catch (error) {
        // The console went away or the answer was cut short: the next round asks again.
      } finally {
        busy = false;
      }
    };
    setInterval(poll, REFRESH_MS);
    document.addEventListener("visibilitychange", function () {
      if (document.visibilityState === "visible") {
        poll();
      }
    });
  }

  // --- live updates -----------------------------------------------------------------------
  const source = document.body.dataset.events;
  if (!source || !window.EventSource) {
    return;
  }
  let notOnPage = 0;

  const events = new EventSource(source);
  events.addEventListener("ready", function () {
    say("Live: changes appear as they happen.", true);
  });
  events.addEventListener("task", function (message) {
    const task = JSON.parse(message.data);
    const scope = scopeOf(task.task_id);
    if (scope) {
      liveAt.set(task.task_id, performance.now());
      apply(scope, task);
      flash(scope);
      if (document.querySelector(".timeline")) {
        say("Live: the task changed (" + task.type + "). Reload for its timeline and chart.", true);
      }
    } else {
      notOnPage += 1;
      say(notOnPage + " change(s) to tasks not on this page. Reload to see them.");
    }
  });
  events.addEventListener("gap", function () {
    say("Some changes may have been missed. Reload to see the current state.");
  });
  events.addEventListener("end", function (message) {
    const reason = JSON.parse(message.data).reason;
    say("Live updates ended: " + reason);
    events.close();
  });
  events.addEventListener("error", function () {
    if (events.readyState === EventSource.CLOSED) {
      say("Live updates stopped (the console refused or went away). Reload to try again.");
    } else {
      say("Live updates interrupted; reconnecting…");
    }
  });
})();
