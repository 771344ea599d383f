// Drives the console in headless Chromium as an operator and an auditor would (playwright-core,
// installed in $ONCEGATE_CONSOLE_NODE by .ci/run; Chromium at $ONCEGATE_CHROMIUM).
//
//   node drive.mjs ADMIN_URL TOKEN UNKNOWN_ACTION_ID SCREENSHOT_DIR [SECOND_UNKNOWN_ACTION_ID]
//
// Signs in, finds the unknown action, resolves it with a reason, checks the write log shows the
// resolution and that the chain verifies, and looks at the pages at a phone's width. Prints one
// JSON line of what it saw; screenshots go to SCREENSHOT_DIR.
import path from "node:path";
import { pathToFileURL } from "node:url";

const { chromium } = await import(
  pathToFileURL(path.join(process.env.ONCEGATE_CONSOLE_NODE, "node_modules/playwright-core/index.mjs")).href
);
const [base, token, unknownId, shots, secondId] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.ONCEGATE_CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-dev-shm-usage"],
});
const out = { errors: [] };
let expect401 = false; // the wrong token's own refusal is expected
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  page.on("pageerror", (e) => out.errors.push(String(e)));
  page.on("console", (m) => {
    if (m.type() !== "error") return;
    if (expect401 && m.text().includes("401")) return;
    out.errors.push(m.text());
  });
  const shot = (name) => page.screenshot({ path: path.join(shots, name + ".png"), fullPage: true });

  await page.goto(base + "/");
  await page.waitForSelector("#login");
  if (unknownId === "--locked") {
    // The README's run command sets no token: whatever is typed, the page says what to do.
    out.nav_hidden = await page.locator("nav").isHidden();
    await page.fill("#token", "anything");
    expect401 = true;
    await page.click("#login button[type=submit]");
    await page.waitForSelector("#login [role=alert]");
    out.locked = await page.textContent("#login [role=alert]");
    await shot("9-locked");
    throw null;
  }
  if (unknownId === "--verify-only") {
    // An auditor checks a log someone edited in the database.
    await page.fill("#token", token);
    await page.click("#login button[type=submit]");
    await page.waitForSelector("#unknown");
    await page.goto(base + "/#/log?after=0");
    await page.waitForSelector("#verify-button");
    await page.click("#verify-button");
    await page.waitForSelector("#verify .banner");
    out.verify = await page.textContent("#verify");
    out.bad_rows = await page.locator("tr.bad").count();
    out.first_bad_row = await page.locator("tr.bad td").first().textContent();
    await shot("8-tampered-log");
    throw null;
  }
  await shot("1-sign-in");
  // A wrong token is refused, and said so.
  await page.fill("#token", "not-the-token");
  expect401 = true;
  await page.click("#login button[type=submit]");
  await page.waitForSelector("#login [role=alert]");
  out.wrong_token = await page.textContent("#login [role=alert]");
  expect401 = false;

  await page.fill("#token", token);
  await page.click("#login button[type=submit]");
  await page.waitForSelector("#unknown");
  out.unknown_listed = (await page.locator(`#unknown a[href="#/actions/${unknownId}"]`).count()) === 1;
  await shot("2-actions");

  await page.click(`#unknown a[href="#/actions/${unknownId}"]`);
  await page.waitForSelector("#settle");
  out.evidence = await page.textContent("main");
  out.lookup_offered = await page.locator("#lookup").count();
  out.body_cut = await page.textContent("#request-body");
  await page.click("#request-body-all");
  out.body_all = await page.textContent("#request-body");
  await shot("3-unknown-action");
  // At a phone's width the decision comes first, and the id does not wrap down the screen.
  await page.setViewportSize({ width: 390, height: 844 });
  await page.reload();
  await page.waitForSelector("#settle");
  out.phone_settle_top = (await page.locator("#settle").boundingBox()).y;
  out.phone_heading_height = (await page.locator("main h1").boundingBox()).height;
  await shot("3-phone-unknown-action");
  await page.setViewportSize({ width: 1280, height: 900 });

  // A reason is required.
  await page.click("#resolve button[type=submit]");
  out.reason_required = await page.evaluate(() => !document.getElementById("reason").checkValidity());
  await page.selectOption("#outcome", "applied");
  await page.fill("#external", "ch_console_1");
  await page.fill("#reason", "checked in the service's dashboard: charge ch_console_1 exists");
  await page.click("#resolve button[type=submit]");
  await page.waitForSelector("#resolved");
  out.entry = JSON.parse(await page.textContent("#entry"));
  await shot("4-resolved");

  await page.goto(base + "/#/log?action=" + unknownId);
  await page.waitForSelector("#verify-button");
  await page.click("#verify-button");
  await page.waitForSelector("#verify .banner");
  out.verify = await page.textContent("#verify");
  out.anchor = await page.textContent("#anchor");
  out.log_text = await page.textContent("main");
  await shot("5-write-log");

  // A resolve's confirmation never replaces the page the operator moved to while it was sent:
  // the second unknown action is resolved, its write-log read held back, the operator goes to
  // the actions list, then the read is let through.
  if (secondId) {
    await page.goto(base + "/#/actions/" + secondId);
    await page.waitForSelector("#settle");
    let releaseEntry;
    const entryHeld = new Promise((r) => (releaseEntry = r));
    const isEntryRead = (url) => url.pathname === "/v1/log" && url.searchParams.get("event") === "resolved";
    await page.route(isEntryRead, async (r) => {
      await entryHeld;
      await r.continue();
    });
    const entryRead = page.waitForEvent("requestfinished", (r) => isEntryRead(new URL(r.url())));
    await page.selectOption("#outcome", "not-applied");
    await page.fill("#reason", "checked in the service's dashboard: no second charge");
    const resolved = page.waitForResponse((r) => r.url().endsWith("/resolve"));
    await page.click("#resolve button[type=submit]");
    await resolved;
    await page.goto(base + "/#/actions");
    await page.waitForSelector("#unknown");
    releaseEntry();
    await entryRead;
    // The confirmation would show itself at once once its read arrived; give it the chance.
    await page.waitForTimeout(300);
    out.kept_after_resolve = await page.textContent("main h1");
    await page.unroute(isEntryRead);
  }

  await page.goto(base + "/#/overview");
  await page.waitForSelector(".tiles");
  out.overview_unknown = await page.textContent('[data-state="unknown"]');
  // The chart: what its bars add up to by kind, and what its legend and tile say.
  out.chart = await page.evaluate(() => {
    const [writes, waiting] = document.querySelectorAll("#activity svg.chart");
    const sum = {};
    for (const r of writes.querySelectorAll("rect[data-kind]")) sum[r.dataset.kind] = (sum[r.dataset.kind] || 0) + Number(r.dataset.n);
    // The tallest minute's bar spans the plot: its stacked heights over the plot's height.
    const heights = [...writes.querySelectorAll("g[data-at]")].map((g) =>
      [...g.querySelectorAll("rect[data-kind]")].reduce((s, r) => s + Number(r.getAttribute("height")), 0),
    );
    const legend = {};
    for (const b of document.querySelectorAll(".legend [data-total]")) legend[b.dataset.total] = Number(b.textContent);
    return {
      sum,
      legend,
      minutes: writes.querySelectorAll("g[data-at]").length,
      tallest: Math.max(...heights),
      waiting_max: Math.max(0, ...[...waiting.querySelectorAll("rect[data-kind]")].map((r) => Number(r.dataset.n))),
      hour_total: Number(document.querySelector('[data-total="writes"]').textContent),
      titles: [...writes.querySelectorAll("g[data-at] title")].map((t) => t.textContent).filter((t) => !t.includes("sent 0, replayed 0, unknown 0, not applied 0, refused 0")),
    };
  });
  await shot("6-overview");

  // A page still loading when the operator moves on never replaces the page they moved to. From
  // the overview (no verify button of an earlier page to match), the actions list is held back
  // until the write log is shown, then let through.
  let release;
  const held = new Promise((r) => (release = r));
  const isList = (url) => url.pathname === "/v1/actions";
  await page.route(isList, async (r) => {
    await held;
    await r.continue();
  });
  const listed = page.waitForEvent("requestfinished", (r) => isList(new URL(r.url())));
  await page.goto(base + "/#/actions");
  await page.goto(base + "/#/log");
  await page.waitForSelector("#verify-button");
  release();
  await listed;
  // The held page would show itself at once once its data arrived; give it the chance.
  await page.waitForTimeout(300);
  out.kept_newer_page = await page.textContent("main h1");
  await page.unroute(isList);

  // A phone's width: every page fits, nothing scrolls sideways but the tables' own boxes.
  await page.setViewportSize({ width: 390, height: 844 });
  out.overflow = {};
  for (const [name, hash] of [["actions", "#/actions"], ["action", "#/actions/" + unknownId], ["log", "#/log"], ["overview", "#/overview"]]) {
    await page.goto(base + "/" + hash);
    await page.waitForSelector("main h1");
    out.overflow[name] = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    await shot("7-phone-" + name);
  }
  // Signing out forgets the token.
  await page.click("#logout");
  await page.waitForSelector("#login");
  out.token_after_logout = await page.evaluate(() => sessionStorage.getItem("oncegate-admin-token"));
  out.cookies = (await page.context().cookies()).length;
} catch (e) {
  if (e !== null) out.failed = String(e.stack || e);
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
