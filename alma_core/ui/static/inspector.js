// The run inspector's one script, served from its own origin (the CSP allows no inline
// script). Every page works without it; with it:
//
// * Copy buttons: a button with data-copy="ID" copies the text of the element ID (a
//   command, an address); without JavaScript the buttons are hidden (CSS: html.js).
// * Live pages without a reload (issue 51): every few seconds the page is fetched again
//   and the parts marked data-live (the run's facts, timeline and history; the runs list
//   and its counts) are swapped for their new selves. Forms are never touched: what the
//   user typed, chose or focused stays. A payload unfolded stays unfolded. The page stops
//   when the server says it is no longer live (a run that completed). Without JavaScript
//   the <noscript> refresh reloads the page instead.
document.documentElement.classList.add("js");

document.addEventListener("click", function (event) {
  var button = event.target.closest("button[data-copy]");
  if (!button) return;
  var source = document.getElementById(button.getAttribute("data-copy"));
  if (!source) return;
  var text = source.getAttribute("href") ? source.href : source.textContent;
  navigator.clipboard.writeText(text.trim()).then(
    function () { button.textContent = "copied"; },
    function () { button.textContent = "select and copy"; }
  );
});

(function () {
  "use strict";
  var every = Number(document.body.getAttribute("data-refresh") || 0);
  if (!every) return;

  function openIn(element) {
    var open = {};
    element.querySelectorAll("details[open]").forEach(function (d) {
      var row = d.closest("[id]");
      if (row) open[row.id] = true;
    });
    return open;
  }

  function swap(fresh) {
    document.querySelectorAll("[data-live]").forEach(function (old) {
      var next = fresh.getElementById(old.id);
      if (!next || next.innerHTML === old.innerHTML) return;
      var focused = document.activeElement;
      if (old.contains(focused) && focused.matches("input, select, textarea")) return; // typing
      var open = openIn(old);
      var copy = document.importNode(next, true);
      copy.querySelectorAll("details").forEach(function (d) {
        var row = d.closest("[id]");
        if (row && open[row.id]) d.setAttribute("open", "");
      });
      old.replaceWith(copy);
    });
  }

  function tick() {
    fetch(location.href, { credentials: "same-origin", headers: { "X-Alma-Live": "1" } })
      .then(function (response) {
        return response.ok ? response.text() : null;
      })
      .then(function (text) {
        if (text === null) return true; // an error page: keep what is shown, try again
        var fresh = new DOMParser().parseFromString(text, "text/html");
        swap(fresh);
        var still = fresh.body && fresh.body.getAttribute("data-refresh");
        return Boolean(still);
      })
      .catch(function () {
        return true; // the inspector restarting, the network away: try again
      })
      .then(function (again) {
        if (again) setTimeout(tick, every * 1000);
        else document.body.removeAttribute("data-refresh");
      });
  }
  setTimeout(tick, every * 1000);
})();
