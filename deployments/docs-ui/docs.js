// The API docs page (/docs): Swagger UI, served by this service (no CDN), over this service's /openapi.json.
// A file of its own rather than an inline script, so the page's Content-Security-Policy can be script-src 'self'.
"use strict";
window.addEventListener("DOMContentLoaded", function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis],
  });
});
