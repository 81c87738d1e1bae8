// relayd console: times in the browser's zone (UTC kept on hover), and the overview's
// figures refreshed in place. No framework, nothing fetched from elsewhere.
"use strict";
(function () {
  function localTimes(root) {
    root.querySelectorAll("time[datetime]").forEach(function (el) {
      var at = new Date(el.getAttribute("datetime"));
      if (isNaN(at.getTime())) return;
      el.textContent = at.toLocaleString(undefined, {
        year: "numeric", month: "short", day: "2-digit",
        hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short"
      });
      el.title = el.title + " (UTC)";
    });
  }
  function refresh(box) {
    var every = parseFloat(box.dataset.everyS || "5") * 1000;
    function tick() {
      fetch(box.dataset.refresh, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
        .then(function (html) {
          box.innerHTML = html;
          localTimes(box);
          box.dataset.refreshed = String(Number(box.dataset.refreshed || "0") + 1);
          box.classList.remove("stale-figures");
        })
        .catch(function () { box.classList.add("stale-figures"); })
        .finally(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    localTimes(document);
    document.querySelectorAll("[data-refresh]").forEach(refresh);
  });
})();
